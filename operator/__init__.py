"""The kopf operator: handlers over pure builders from custom resources to Kubernetes objects."""
