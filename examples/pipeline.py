import torch, sbpflow
BATCH_SIZE = 16
BROADCAST = [sbpflow.sbp.broadcast]
P0 = sbpflow.placement("cpu", [0])
P1 = sbpflow.placement("cpu", [1])

class Stage0Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = torch.nn.Flatten()
        self.linear0 = torch.nn.Linear(28 * 28, 512)
        self.relu0 = torch.nn.ReLU()
    def forward(self, x):
        return self.relu0(self.linear0(self.flatten(x)))

class Stage1Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(512, 512)
        self.relu1 = torch.nn.ReLU()
        self.linear2 = torch.nn.Linear(512, 10)
        self.relu2 = torch.nn.ReLU()
    def forward(self, x):
        return self.relu2(self.linear2(self.relu1(self.linear1(x))))

class PipelineModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.m_stage0 = Stage0Module()
        self.m_stage1 = Stage1Module()
        self.m_stage0.to_global(placement=P0, sbp=BROADCAST)
        self.m_stage1.to_global(placement=P1, sbp=BROADCAST)
    def forward(self, x):
        out_stage0 = self.m_stage0(x)
        in_stage1 = out_stage0.to_global(placement=P1, sbp=BROADCAST)
        return self.m_stage1(in_stage1)

module_pipeline = PipelineModule()
sgd = torch.optim.SGD(module_pipeline.parameters(), lr=0.001)

class PipelineGraph(sbpflow.nn.Graph):
    def __init__(self):
        super().__init__()
        self.module_pipeline = module_pipeline
        self.module_pipeline.m_stage0.config.set_stage(stage_id=0, placement=P0)
        self.module_pipeline.m_stage1.config.set_stage(stage_id=1, placement=P1)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(sgd)
    def build(self, x, y):
        out = self.module_pipeline(x)
        loss = self.loss_fn(out, y)
        loss.backward()
        return loss

graph_pipeline = PipelineGraph()
x = torch.randn(BATCH_SIZE, 1, 28, 28).to_global(P0, BROADCAST)
y = torch.randint(0, 10, (BATCH_SIZE,)).to_global(P1, BROADCAST)
for i in range(20):
    loss = graph_pipeline(x, y)
    if sbpflow.env.get_rank() in P1:  # the loss lives on the last stage's rank
        print(f"step {i} loss {loss.to_local().item():.6f}", flush=True)
