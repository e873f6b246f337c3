"""The bottom layer under every room (standard library only): records, hooks, failures, settings."""
