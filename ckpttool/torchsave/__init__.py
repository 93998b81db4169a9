"""The torch.save format, in one place: ckpttool writes it without importing torch.

    zip.py      the uncompressed zip: reading its directory, laying out entries to write
    pickle.py   a small protocol-2 pickle writer: plain data and stand-ins for torch's objects
    archive.py  a torch.save archive's entries and order; the pickle of a tensor in data.pkl
    record.py   one tensor's record (a DCP blob): layout to stream into, reading, checks
    ptfile.py   a nested .pt (torch.save of a state dict) laid out so tensors copy into place
    crc32.py    the CRC-32 of joined or cut records' data from their stored CRC-32s
"""
