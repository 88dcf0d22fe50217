"""The measuring half of ``hetplan profile``: what the command runs on the
runtime to time layers, data-parallel wrappers and collectives.

It writes the ProfileDB format that ``hetplan.profile`` defines and the
planner reads; the planner side never imports this package.

- ``cli``: the command (flags, checks, launch, summary); imports without torch.
- ``job``: what every process measures (``ProfileJob``); torch-free.
- ``measure``: the run on each process (needs torch).
- ``collectives``: communication curves and their alpha-beta fits.
- ``timing``: timing regions and the statistics kept.
"""
