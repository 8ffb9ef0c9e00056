"""What a model is to swakv: its layers' attention specs read from a transformers config
(``layer_kinds``) and the tiny random models the tests and the CPU demo run (``tiny_models``)."""
