"""F-TIS sample exchange: the first algorithm (`algorithm.kind: ftis`)."""
