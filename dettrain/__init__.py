"""dettrain: distributed PyTorch training whose runs reproduce bit for bit (see README.md and DESIGN.md)."""

__version__ = "0.1.0"
