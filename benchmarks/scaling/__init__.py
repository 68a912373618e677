"""The scaling model and its measurements: the model (model.py), the measured scaling study (scaling.py),
its calibration on gloo runs (scaling_calibrate.py) and its validation against published tables
(scaling_validate.py); machine, workload and input-path profiles in profiles/."""
