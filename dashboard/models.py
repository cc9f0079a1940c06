# The dashboard owns no tables: it reads through the selectors of the other apps.
