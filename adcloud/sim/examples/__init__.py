"""Example nodes for replay simulation, exercised by the tests.

- :mod:`~adcloud.sim.examples.obstacle_node` -- a Python pipe node (BinPipe on
  stdin/stdout through :func:`adcloud.binpipe.node.run_node`);
- ``obstacle_ros_node.py`` -- the same detector as a rospy node (system Python), fed
  through topics by the ``ros1`` adapter.
"""
