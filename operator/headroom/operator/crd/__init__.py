"""The InferenceDeployment CRD: pydantic models (the single source of the schema), the CEL rules
with their Python twins, and the generated YAML."""
