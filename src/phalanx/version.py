"""The package version, in a module of its own so that any layer can read it without importing the
package root (whose exports load the Session)."""

__version__ = "0.1.0"
