"""Model code shared by target and draft: one decoder layer, weight adapters, loaders."""
