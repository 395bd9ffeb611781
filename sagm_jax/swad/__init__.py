"""SWAD (Cha et al., NeurIPS 2021): the loss valley that picks the averaged segment
(``valley``), the weight averages kept on the devices (``averages``), and SWAD inside a
run (``run``)."""
