"""Input plumbing: reading user files safely (userfiles), typed fields of those files (fields) and
command-line argument types (argtypes). Below every other package but ``errors``."""
