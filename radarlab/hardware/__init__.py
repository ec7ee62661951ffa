"""The machine under the model: the roofline (roofline.py) and measurements of this machine (measure.py)."""
