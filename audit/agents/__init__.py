"""The agents the product runs. ``assistant`` is the built-in one (SPEC §5)."""
