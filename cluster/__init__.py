"""Topology config, launcher and the `tandem` command line."""
