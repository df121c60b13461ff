"""Pure builders: desired Kubernetes objects (plain dicts) from parsed specs. No API calls here."""
