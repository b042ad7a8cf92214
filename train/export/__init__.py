"""`python -m train.export`: the command line over `heads.formats` (export a trained head to
a serving format, or import a foreign checkpoint as ours)."""
