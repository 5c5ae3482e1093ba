"""headroom.operator: the InferenceDeployment CRD, its kopf handlers and the scaling loop."""
