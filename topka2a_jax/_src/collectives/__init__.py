"""The exchanges of one flat buffer, and how their entries are chosen and sent."""
