"""zero_ext's version: the bottom room holds it, so every room (the
environment report, wrap()'s fingerprint) reads it without importing the
package root that imports them."""
__version__ = "0.1.0"
