"""Where bytes are read from: local paths and object-storage URLs behind one interface
(storage; s3: a standard-library S3 reader), coalesced ranged reads (spans), byte-range copies
and the bounded thread pool (io), and path safety (safepaths). Imports only `core`."""
