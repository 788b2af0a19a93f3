"""The package version, on the bottom floor so that any stage can record it without importing the package root."""

__version__ = "0.1.0"
