"""The release, in the one place pyproject.toml reads it (statically, without importing the
package), below every module that reports it."""

__version__ = "0.2.0"
