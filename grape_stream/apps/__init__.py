"""Command-line applications built on the library: the demo, inspect, plot."""
