"""Devices and models without the hardware: model presets from published configs (``presets``), GPU
presets (``gpus``), the roofline step-cost model (``cost_model``) and the simulated worker that executes
the step protocol against it (``simulated``). No torch."""
