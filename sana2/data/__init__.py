"""Training data, one job per module.

features.py        the on-disk feature format (versions 1 and 2, its specification) and its reader
writer.py          writes that format: whole datasets from tensors, or shard by shard
loader.py          DistributedFeatureLoader: deterministic, resumable global batches of one bucket each
digits.py          the embedded 8x8 digits (digits.csv.gz), captioned and encoded on first use
build.py           build_training_data: the dataset (features, or online encoding), loader, held-out set
                   and null caption a run's config names

From a user's images and captions (sana2-prepare, and online encoding):
sources.py         the input layouts (image folders, JSONL manifests, webdataset tars) and caption choice
buckets.py         Sana's aspect-ratio tables and the nearest-ratio rule
image.py           decoding, resizing and centre-cropping an image to its bucket
video_sources.py   the clip layouts (folders of clips, JSONL manifests, Sana's zips) with Sana's captions
video_decode.py    PyAV: a clip's frames at a target rate, cropped to its bucket; writing mp4
frame_window.py    which frames a clip contributes (num_frames at fps, where they start)
dataset_plan.py    the data manifest: every usable sample in its bucket and shard, every skip with its reason
shard_encoding.py  images and captions through the encoders, batch by batch
prepared_output.py sana2-prepare's output folder: resuming, completing, its summary
online.py          OnlineDataset: the same samples encoded in the training step
"""
