"""Plots and widgets. The numbers behind them are computed elsewhere in radarlab."""
