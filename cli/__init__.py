"""autotp command-line interface."""
