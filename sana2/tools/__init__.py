"""Command-line tools: sana2-convert (convert_checkpoint.py) and its export, import and verify steps.

The checkpoint file formats they read and write live in sana2/formats.
"""
