"""Background work beside the gateways: the archive worker and the Spark job."""
