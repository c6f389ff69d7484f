# rank 0 of 4, device digits [2, 2], coordinates [0, 0]
# gpt2-tiny, B=8, S=64: size arguments are this rank's blocks; the type annotations are the captured graph's (whole tensors at the example sizes)
# what each module of the code below does (which tensor, which ranks, which direction):
# target_count_1 = TargetCount(ignore_index=-100, counted whole from the inputs)
# redistribute_1 = Redistribute(input_ids -> embedding: forward (8, 64)->(4, 64), sends to [], recvs from []; backward
#     none)
# vocab_embedding_1 = VocabEmbedding(rows [0, 128))
# redistribute_2 = Redistribute(arange -> embedding_1: forward (64,)->(32,), sends to [], recvs from []; backward
#     none)
# redistribute_3 = Redistribute(embedding -> add: forward (4, 64, 64)->(4, 32, 64), reduce-scatter over [0, 1];
#     backward (4, 32, 64)->(4, 64, 64), sends to [1], recvs from [1])
# all_reduce_4 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of add)
# gather_linears_1 = GatherLinears(layer_norm -> linear: gather (4, 32, 64)->(4, 64, 64) into 1 linear(s) by rows;
#     backward ReduceScatter)
# linear_scatter_1 = LinearScatter(linear_1 -> add_1: linear, then reduce-scatter (4, 64, 64)->(4, 32, 64) over [0, 1]
#     by rows)
# all_reduce_2 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=bias gradient of linear_1 over its scattered
#     pieces)
# gather_linears_2 = GatherLinears(layer_norm_1 -> linear_2: gather (4, 32, 64)->(4, 64, 64) into 1 linear(s) by rows;
#     backward ReduceScatter)
# linear_scatter_2 = LinearScatter(linear_3 -> add_2: linear, then reduce-scatter (4, 64, 64)->(4, 32, 64) over [0, 1]
#     by rows)
# all_reduce_7 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=bias gradient of linear_3 over its scattered
#     pieces)
# gather_linears_3 = GatherLinears(layer_norm_2 -> linear_4: gather (4, 32, 64)->(4, 64, 64) into 1 linear(s) by rows;
#     backward ReduceScatter)
# linear_scatter_3 = LinearScatter(linear_5 -> add_3: linear, then reduce-scatter (4, 64, 64)->(4, 32, 64) over [0, 1]
#     by rows)
# all_reduce_12 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=bias gradient of linear_5 over its scattered
#     pieces)
# gather_linears_4 = GatherLinears(layer_norm_3 -> linear_6: gather (4, 32, 64)->(4, 64, 64) into 1 linear(s) by rows;
#     backward ReduceScatter)
# linear_scatter_4 = LinearScatter(linear_7 -> add_4: linear, then reduce-scatter (4, 64, 64)->(4, 32, 64) over [0, 1]
#     by rows)
# all_reduce_15 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=bias gradient of linear_7 over its scattered
#     pieces)
# gather_linears_5 = GatherLinears(layer_norm_4 -> linear_8: gather (4, 32, 64)->(4, 64, 64) into 1 linear(s) by rows;
#     backward ReduceScatter)
# redistribute_13 = Redistribute(labels -> roll: forward (8, 64)->(4, 64), sends to [], recvs from []; backward none)
# cross_entropy_1 = ShardedCrossEntropy(reduction=mean, classes from 0 over ranks (0, 1), rows over ranks (0, 2))
# parameter gradients summed over their replicas outside the graph, in gradient buckets during backward:
# over ranks (0, 1): p_embed_positions_weight
# over ranks (0, 1, 2, 3): p_blocks_0_attn_norm_weight, p_blocks_0_attn_norm_bias, p_blocks_0_mlp_norm_weight,
#     p_blocks_0_mlp_norm_bias, p_blocks_1_attn_norm_weight, p_blocks_1_attn_norm_bias, p_blocks_1_mlp_norm_weight,
#     p_blocks_1_mlp_norm_bias, p_final_norm_weight, p_final_norm_bias
# over ranks (0, 2): p_blocks_0_attn_qkv_proj_weight, p_blocks_0_attn_qkv_proj_bias, p_blocks_0_attn_o_proj_weight,
#     p_blocks_0_attn_o_proj_bias, p_blocks_0_mlp_up_proj_weight, p_blocks_0_mlp_up_proj_bias,
#     p_blocks_0_mlp_down_proj_weight, p_blocks_0_mlp_down_proj_bias, p_blocks_1_attn_qkv_proj_weight,
#     p_blocks_1_attn_qkv_proj_bias, p_blocks_1_attn_o_proj_weight, p_blocks_1_attn_o_proj_bias,
#     p_blocks_1_mlp_up_proj_weight, p_blocks_1_mlp_up_proj_bias, p_blocks_1_mlp_down_proj_weight,
#     p_blocks_1_mlp_down_proj_bias, p_lm_head_weight
class PrimeParRank0(torch.nn.Module):
    def forward(self, p_embed_tokens_weight: "f32[256, 64]", p_embed_positions_weight: "f32[128, 64]", p_blocks_0_attn_norm_weight: "f32[64]", p_blocks_0_attn_norm_bias: "f32[64]", p_blocks_0_attn_qkv_proj_weight: "f32[192, 64]", p_blocks_0_attn_qkv_proj_bias: "f32[192]", p_blocks_0_attn_o_proj_weight: "f32[64, 64]", p_blocks_0_attn_o_proj_bias: "f32[64]", p_blocks_0_mlp_norm_weight: "f32[64]", p_blocks_0_mlp_norm_bias: "f32[64]", p_blocks_0_mlp_up_proj_weight: "f32[256, 64]", p_blocks_0_mlp_up_proj_bias: "f32[256]", p_blocks_0_mlp_down_proj_weight: "f32[64, 256]", p_blocks_0_mlp_down_proj_bias: "f32[64]", p_blocks_1_attn_norm_weight: "f32[64]", p_blocks_1_attn_norm_bias: "f32[64]", p_blocks_1_attn_qkv_proj_weight: "f32[192, 64]", p_blocks_1_attn_qkv_proj_bias: "f32[192]", p_blocks_1_attn_o_proj_weight: "f32[64, 64]", p_blocks_1_attn_o_proj_bias: "f32[64]", p_blocks_1_mlp_norm_weight: "f32[64]", p_blocks_1_mlp_norm_bias: "f32[64]", p_blocks_1_mlp_up_proj_weight: "f32[256, 64]", p_blocks_1_mlp_up_proj_bias: "f32[256]", p_blocks_1_mlp_down_proj_weight: "f32[64, 256]", p_blocks_1_mlp_down_proj_bias: "f32[64]", p_final_norm_weight: "f32[64]", p_final_norm_bias: "f32[64]", p_lm_head_weight: "f32[256, 64]", input_ids: "i64[8, 64]", labels: "i64[8, 64]"):
        target_count_1 = self.target_count_1(labels)
        redistribute_1 = self.redistribute_1(input_ids);  input_ids = None
        vocab_embedding_1 = self.vocab_embedding_1(p_lm_head_weight, redistribute_1);  redistribute_1 = None
        arange: "i64[64]" = torch.ops.aten.arange.default(64, device = device(type='meta'), pin_memory = False)
        redistribute_2 = self.redistribute_2(arange);  arange = None
        embedding_1: "f32[64, 64]" = torch.ops.aten.embedding.default(p_embed_positions_weight, redistribute_2);  p_embed_positions_weight = redistribute_2 = None
        redistribute_3 = self.redistribute_3(vocab_embedding_1);  vocab_embedding_1 = None
        all_reduce_4 = self.all_reduce_4(embedding_1);  embedding_1 = None
        add: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(redistribute_3, all_reduce_4);  redistribute_3 = all_reduce_4 = None
        layer_norm: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add, [64], p_blocks_0_attn_norm_weight, p_blocks_0_attn_norm_bias, 1e-05, False);  p_blocks_0_attn_norm_weight = p_blocks_0_attn_norm_bias = None
        gather_linears_1 = self.gather_linears_1(layer_norm, p_blocks_0_attn_qkv_proj_weight, p_blocks_0_attn_qkv_proj_bias);  layer_norm = p_blocks_0_attn_qkv_proj_weight = p_blocks_0_attn_qkv_proj_bias = None
        getitem_6: "f32[8, 64, 192]" = gather_linears_1[0];  gather_linears_1 = None
        view: "f32[8, 64, 4, 3, 16]" = torch.ops.aten.reshape.default(getitem_6, [4, 64, 2, 3, 16]);  getitem_6 = None
        unbind = torch.ops.aten.unbind.int(view, 3);  view = None
        getitem: "f32[8, 64, 4, 16]" = unbind[0]
        getitem_1: "f32[8, 64, 4, 16]" = unbind[1]
        getitem_2: "f32[8, 64, 4, 16]" = unbind[2];  unbind = None
        transpose: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem, 1, 2);  getitem = None
        transpose_1: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_1, 1, 2);  getitem_1 = None
        transpose_2: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_2, 1, 2);  getitem_2 = None
        scaled_dot_product_attention: "f32[8, 4, 64, 16]" = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
        transpose_3: "f32[8, 64, 4, 16]" = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
        reshape: "f32[8, 64, 64]" = torch.ops.aten.reshape.default(transpose_3, [4, 64, 32]);  transpose_3 = None
        linear_scatter_1: "f32[8, 64, 64]" = self.linear_scatter_1(reshape, p_blocks_0_attn_o_proj_weight);  reshape = p_blocks_0_attn_o_proj_weight = None
        all_reduce_41 = self.all_reduce_2(p_blocks_0_attn_o_proj_bias);  p_blocks_0_attn_o_proj_bias = None
        add_tensor_4 = torch.ops.aten.add.Tensor(linear_scatter_1, all_reduce_41);  linear_scatter_1 = all_reduce_41 = None
        add_1: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(add, add_tensor_4);  add = add_tensor_4 = None
        layer_norm_1: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add_1, [64], p_blocks_0_mlp_norm_weight, p_blocks_0_mlp_norm_bias, 1e-05, False);  p_blocks_0_mlp_norm_weight = p_blocks_0_mlp_norm_bias = None
        gather_linears_2 = self.gather_linears_2(layer_norm_1, p_blocks_0_mlp_up_proj_weight, p_blocks_0_mlp_up_proj_bias);  layer_norm_1 = p_blocks_0_mlp_up_proj_weight = p_blocks_0_mlp_up_proj_bias = None
        getitem_7: "f32[8, 64, 256]" = gather_linears_2[0];  gather_linears_2 = None
        gelu: "f32[8, 64, 256]" = torch.ops.aten.gelu.default(getitem_7, approximate = 'tanh');  getitem_7 = None
        linear_scatter_2: "f32[8, 64, 64]" = self.linear_scatter_2(gelu, p_blocks_0_mlp_down_proj_weight);  gelu = p_blocks_0_mlp_down_proj_weight = None
        all_reduce_42 = self.all_reduce_7(p_blocks_0_mlp_down_proj_bias);  p_blocks_0_mlp_down_proj_bias = None
        add_tensor_5 = torch.ops.aten.add.Tensor(linear_scatter_2, all_reduce_42);  linear_scatter_2 = all_reduce_42 = None
        add_2: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(add_1, add_tensor_5);  add_1 = add_tensor_5 = None
        layer_norm_2: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add_2, [64], p_blocks_1_attn_norm_weight, p_blocks_1_attn_norm_bias, 1e-05, False);  p_blocks_1_attn_norm_weight = p_blocks_1_attn_norm_bias = None
        gather_linears_3 = self.gather_linears_3(layer_norm_2, p_blocks_1_attn_qkv_proj_weight, p_blocks_1_attn_qkv_proj_bias);  layer_norm_2 = p_blocks_1_attn_qkv_proj_weight = p_blocks_1_attn_qkv_proj_bias = None
        getitem_8: "f32[8, 64, 192]" = gather_linears_3[0];  gather_linears_3 = None
        view_1: "f32[8, 64, 4, 3, 16]" = torch.ops.aten.reshape.default(getitem_8, [4, 64, 2, 3, 16]);  getitem_8 = None
        unbind_1 = torch.ops.aten.unbind.int(view_1, 3);  view_1 = None
        getitem_3: "f32[8, 64, 4, 16]" = unbind_1[0]
        getitem_4: "f32[8, 64, 4, 16]" = unbind_1[1]
        getitem_5: "f32[8, 64, 4, 16]" = unbind_1[2];  unbind_1 = None
        transpose_4: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_3, 1, 2);  getitem_3 = None
        transpose_5: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_4, 1, 2);  getitem_4 = None
        transpose_6: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_5, 1, 2);  getitem_5 = None
        scaled_dot_product_attention_1: "f32[8, 4, 64, 16]" = torch.ops.aten.scaled_dot_product_attention.default(transpose_4, transpose_5, transpose_6, None, 0.0, True);  transpose_4 = transpose_5 = transpose_6 = None
        transpose_7: "f32[8, 64, 4, 16]" = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
        reshape_1: "f32[8, 64, 64]" = torch.ops.aten.reshape.default(transpose_7, [4, 64, 32]);  transpose_7 = None
        linear_scatter_3: "f32[8, 64, 64]" = self.linear_scatter_3(reshape_1, p_blocks_1_attn_o_proj_weight);  reshape_1 = p_blocks_1_attn_o_proj_weight = None
        all_reduce_43 = self.all_reduce_12(p_blocks_1_attn_o_proj_bias);  p_blocks_1_attn_o_proj_bias = None
        add_tensor_6 = torch.ops.aten.add.Tensor(linear_scatter_3, all_reduce_43);  linear_scatter_3 = all_reduce_43 = None
        add_3: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(add_2, add_tensor_6);  add_2 = add_tensor_6 = None
        layer_norm_3: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add_3, [64], p_blocks_1_mlp_norm_weight, p_blocks_1_mlp_norm_bias, 1e-05, False);  p_blocks_1_mlp_norm_weight = p_blocks_1_mlp_norm_bias = None
        gather_linears_4 = self.gather_linears_4(layer_norm_3, p_blocks_1_mlp_up_proj_weight, p_blocks_1_mlp_up_proj_bias);  layer_norm_3 = p_blocks_1_mlp_up_proj_weight = p_blocks_1_mlp_up_proj_bias = None
        getitem_9: "f32[8, 64, 256]" = gather_linears_4[0];  gather_linears_4 = None
        gelu_1: "f32[8, 64, 256]" = torch.ops.aten.gelu.default(getitem_9, approximate = 'tanh');  getitem_9 = None
        linear_scatter_4: "f32[8, 64, 64]" = self.linear_scatter_4(gelu_1, p_blocks_1_mlp_down_proj_weight);  gelu_1 = p_blocks_1_mlp_down_proj_weight = None
        all_reduce_44 = self.all_reduce_15(p_blocks_1_mlp_down_proj_bias);  p_blocks_1_mlp_down_proj_bias = None
        add_tensor_7 = torch.ops.aten.add.Tensor(linear_scatter_4, all_reduce_44);  linear_scatter_4 = all_reduce_44 = None
        add_4: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(add_3, add_tensor_7);  add_3 = add_tensor_7 = None
        layer_norm_4: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add_4, [64], p_final_norm_weight, p_final_norm_bias, 1e-05, False);  add_4 = p_final_norm_weight = p_final_norm_bias = None
        gather_linears_5 = self.gather_linears_5(layer_norm_4, p_lm_head_weight);  layer_norm_4 = p_lm_head_weight = None
        getitem_10: "f32[8, 64, 256]" = gather_linears_5[0];  gather_linears_5 = None
        arange_1: "i64[64]" = torch.ops.aten.arange.default(64, device = device(type='meta'), pin_memory = False)
        eq: "b8[64]" = torch.ops.aten.eq.Scalar(arange_1, 63);  arange_1 = None
        redistribute_13 = self.redistribute_13(labels);  labels = None
        roll: "i64[8, 64]" = torch.ops.aten.roll.default(redistribute_13, [-1], [1]);  redistribute_13 = None
        masked_fill: "i64[8, 64]" = torch.ops.aten.masked_fill.Scalar(roll, eq, -100);  roll = eq = None
        reshape_2: "f32[512, 256]" = torch.ops.aten.reshape.default(getitem_10, [256, 128]);  getitem_10 = None
        reshape_3: "i64[512]" = torch.ops.aten.reshape.default(masked_fill, [256]);  masked_fill = None
        cross_entropy_1 = self.cross_entropy_1(reshape_2, reshape_3, target_count_1);  reshape_2 = reshape_3 = target_count_1 = None
        return (cross_entropy_1,)
