"""The documentation's examples and reference tables, checked against the code."""
