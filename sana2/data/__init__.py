"""Training data, one job per module.

features.py  the on-disk feature format (its specification) and its reader, FeatureDataset
writer.py    write_feature_dataset: writes that format
loader.py    DistributedFeatureLoader: deterministic, resumable global batches split over ranks
digits.py    the embedded 8x8 digits (digits.csv.gz), captioned and encoded on first use
build.py     build_training_data: the dataset, loader and held-out set a run's config names
"""
