"""The whole stack as processes, through `dsaserve up` or its parts, with real clients."""
