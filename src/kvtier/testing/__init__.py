"""Test support shipped with the package (probe connector, restore check). Not for production."""
