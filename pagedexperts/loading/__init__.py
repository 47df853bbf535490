"""Loading: one validated config, the model build, one fill path, the runtime object, the independence check."""
