"""One holder at a time: an OS lock on a local file (`file_lock.py`: run directories, T5X
writes, conversions, exports) and a conditionally created gs:// object with a heartbeat
(`gcs_lock.py`: the same on Cloud Storage); `output_lock.py` takes either for one output file
(a decode's JSONL). All name the holder (host, pid, since) in the error a second writer gets."""
