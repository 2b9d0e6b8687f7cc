"""Pacer's services (installed as the ``pacer_services`` package): one folder each."""
