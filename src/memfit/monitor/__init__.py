"""Watching memory while training: the Monitor, its run files and the findings."""
