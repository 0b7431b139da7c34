"""Apps and scripts the tests run in child processes (``python -m`` or ``module:app``)."""
