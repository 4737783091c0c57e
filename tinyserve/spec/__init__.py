"""Speculative decoding behind one interface (`Speculator`): draft proposers (n-gram; MTP drafts
come from the runner's forward), the acceptance rule and its counters, the MTP token map."""
