"""Command-line tools: sana2-convert (convert_checkpoint.py) and the file formats it reads and writes."""
