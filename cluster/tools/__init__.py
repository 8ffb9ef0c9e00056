"""Offline jobs of the `swakv` command: ``swakv plan`` (``planner``), ``swakv demo`` (``demo``), training
the bundled default model (``train_default_model``), and the argparse value types they share (``args``)."""
