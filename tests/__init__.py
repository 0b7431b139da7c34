"""The test suite, as a package: tests import their support code by package path."""
