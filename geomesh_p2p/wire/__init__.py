"""Wire format: .proto files and their generated stubs (committed; regenerate with ``make protos``)."""
