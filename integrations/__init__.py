"""Integrations with other libraries (installed as ``qlinear.integrations``)."""
