"""Speculative decoding: the acceptance rule and each server's, proposers (DFlash, n-gram, hybrid), the generate
loops, and whether outputs are the target's. Uses the drafter and target wings."""
