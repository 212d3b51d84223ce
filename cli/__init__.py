"""The ``fedge`` command line."""
