"""Clusters: the GPU catalog (catalog), ClusterSpec (spec), presets (presets) and YAML files and
loading by name or file (io)."""
