"""The version of zerodp, on its own so that any layer can name it without importing the face."""
__version__ = "0.1.0"
