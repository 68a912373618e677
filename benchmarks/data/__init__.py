"""The input pipeline: dptrain's threads against torch's DataLoader (data_pipeline), photo-like JPEGs
(photo_lmdb) and the GPU session's data stage (data_stage)."""
