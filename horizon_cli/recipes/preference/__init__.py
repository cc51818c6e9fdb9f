"""Preference pairs: DPO, cDPO, IPO, SimPO, ORPO (loss), their reference pass (reference), batches, recipe."""
