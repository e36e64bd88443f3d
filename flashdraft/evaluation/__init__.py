"""τ of a drafter: evaluation records, the offline walk, online and served decoding, results and reports, the
`eval` run. Uses the data, serving, decoding, drafter and target wings."""
