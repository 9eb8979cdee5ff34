"""The run configuration: its schema, loading with dotted overrides, validation, the TIS defaults it
resolves, and the registry through which plug-in packages add schedulers, sections and factories."""
